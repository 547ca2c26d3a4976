# Stage 2, simulate: one job per experiment x hardware x policy, running every round (and
# load, on a load axis) from the workload jobs' traces in one process (so --cores N and a
# cluster run policies in parallel; a job per round paid Python's start-up 315 times for
# runs most of which take under a second), one merge per experiment of all its jobs, and
# technical note 4's sweep.
# Inputs include the simulator's source files: editing the simulator reruns simulations,
# editing a notebook or a note does not.


rule simulate:
    input:
        experiment="config/experiments/{exp}.yaml",
        traces=get_sim_traces,  # every round (and load) of the experiment: one process runs them all
        hardware=get_hardware_files,
        coefficients=get_sim_coefficients,  # the probe calibration of measured CPU hardware (measure.probe)
        sources=SIM_CORE_SOURCES,
        policy_sources=get_policy_sources,  # this policy's modules, not every policy's
    output:
        requests="results/sim/{exp}/{hardware}/{policy}/requests.parquet",
        summary="results/sim/{exp}/{hardware}/{policy}/summary.csv",
        meta="results/sim/{exp}/{hardware}/{policy}/run.json",
    params:
        spec=get_policy_spec,
        out=output_dir("requests"),
        coefficients=get_sim_coefficients_arg,
        traces=get_sim_traces_arg,
    log:
        "results/logs/simulate/{exp}/{hardware}/{policy}.log",
    benchmark:
        "results/benchmarks/simulate/{exp}/{hardware}/{policy}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute simulate {input.experiment:q} {params.traces} --hardware {wildcards.hardware:q}"
        " --policy {params.spec:q} --out {params.out:q} {params.coefficients} > {log:q} 2>&1"


rule merge:
    input:
        unpack(get_merge_inputs),
    output:
        requests="results/sim/{exp}/requests.parquet",
        summary="results/sim/{exp}/summary.csv",
    params:
        dirs=input_dirs("requests"),
        out=output_dir("requests"),
    log:
        "results/logs/merge/{exp}.log",
    benchmark:
        "results/benchmarks/merge/{exp}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute merge --out {params.out:q} {params.dirs:q} > {log:q} 2>&1"


rule arithmetic:
    input:
        sources=ARITHMETIC_SOURCES,
    output:
        requests=f"results/sim/{ARITHMETIC_NAME}/requests.parquet",
        summary=f"results/sim/{ARITHMETIC_NAME}/summary.csv",
        predictions=f"results/sim/{ARITHMETIC_NAME}/predictions.csv",
    params:
        out=output_dir("requests"),
    log:
        "results/logs/arithmetic.log",
    benchmark:
        "results/benchmarks/arithmetic.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute arithmetic --out {params.out:q} > {log:q} 2>&1"
