# Stage 1, workload: one trace per experiment and round, shared by every policy and
# hardware of that round so policies are compared on identical traffic.


rule workload:
    input:
        unpack(get_workload_inputs),
    output:
        trace="results/workload/{exp}/round{round}.parquet",
    log:
        "results/logs/workload/{exp}/round{round}.log",
    benchmark:
        "results/benchmarks/workload/{exp}/round{round}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute workload {input.experiment:q} --round {wildcards.round} --out {output.trace:q} > {log:q} 2>&1"
