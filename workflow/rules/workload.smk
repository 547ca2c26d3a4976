# Stage 1, workload: one trace per experiment and round (and load, on a load axis: the
# `loaddir` "loadV/", empty otherwise), shared by every policy and hardware of that round
# so policies are compared on identical traffic. A dataset workload (workload.dataset)
# converts a recorded trace, fetched first by fetch_mooncake. An experiment with an
# operating point (key operating_point) has one workload parameter chosen first, by
# rule operating_point's search over simulations.


rule fetch_mooncake:
    """The original trace file from its location (raw GitHub at a pinned commit) when it
    can be had, else the project's copy; SHA-256 verified either way, the log says which."""
    input:
        kept="data/mooncake/{name}_trace.jsonl.gz",
    output:
        trace="results/data/mooncake/{name}_trace.jsonl",
    wildcard_constraints:
        name="conversation|synthetic",
    params:
        dest=output_dir("trace"),
    log:
        "results/logs/fetch/mooncake/{name}.log",
    benchmark:
        "results/benchmarks/fetch/mooncake/{name}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute -v fetch mooncake --name {wildcards.name} --dest {params.dest:q} --copy {input.kept:q} > {log:q} 2>&1"


rule operating_point:
    """The workload parameter at which one policy's metric equals a published value
    (kvroute.sim.operating_point): every evaluation is recorded in the file."""
    input:
        unpack(get_operating_point_inputs),
    output:
        point=f"{RESULTS}/operating_point/{{exp}}.json",
    params:
        coefficients=get_operating_point_coefficients_arg,
    log:
        f"{RESULTS}/logs/operating_point/{{exp}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/operating_point/{{exp}}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute -v operating-point {input.experiment:q} --out {output.point:q} {params.coefficients} > {log:q} 2>&1"


rule workload:
    input:
        unpack(get_workload_inputs),
    output:
        trace="results/workload/{exp}/{loaddir}round{round}.parquet",
    log:
        "results/logs/workload/{exp}/{loaddir}round{round}.log",
    benchmark:
        "results/benchmarks/workload/{exp}/{loaddir}round{round}.tsv"
    params:
        load=get_load_arg,
        dataset=get_workload_dataset_arg,
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute workload {input.experiment:q} --round {wildcards.round} {params.load} --out {output.trace:q} {params.dataset} > {log:q} 2>&1"
