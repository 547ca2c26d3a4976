# Stage 1, workload: one trace per experiment and round (and load, on a load axis: the
# `loaddir` "loadV/", empty otherwise), shared by every policy and hardware of that round
# so policies are compared on identical traffic.


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
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute workload {input.experiment:q} --round {wildcards.round} {params.load} --out {output.trace:q} > {log:q} 2>&1"
