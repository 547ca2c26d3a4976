# Target `field` (`make field`): the studies too large for `paper`'s time, config key
# field_experiments (Mooncake's whole traces, every policy, every speed-up). Their
# workload, simulate and merge jobs are the usual ones; this rule tabulates the merged
# summaries beside each trace's own bound on prefix reuse (kvroute.analysis.whole_traces).


rule field_whole_traces:
    input:
        summaries=lambda wildcards: [f"{RESULTS}/sim/{name}/summary.csv" for name in get_field_experiments()],
        experiments=lambda wildcards: [experiment_file(name) for name in get_field_experiments()],
        traces=sorted(glob.glob("data/mooncake/*.jsonl.gz")),
        code=_sources("src/kvroute/analysis/whole_traces.py", "src/kvroute/workload/mooncake.py"),
    output:
        csv=f"{RESULTS}/field/whole_traces.csv",
        md=f"{RESULTS}/field/whole_traces.md",
    params:
        sims=lambda wildcards, input: " ".join(f"--sim {Path(p).parent}" for p in input.summaries),
        out=output_dir("csv"),
    log:
        f"{RESULTS}/logs/field/whole_traces.log",
    conda:
        "../../envs/analysis.yaml"
    shell:
        "python -m kvroute.analysis.whole_traces {params.sims} --out {params.out:q} > {log:q} 2>&1"
