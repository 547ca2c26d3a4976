# Stage 3b, validate: every prediction beside what it predicts (`kvroute validate`):
# results/validation/summary.csv (simulated against measured, like for like: the same
# policy, or a production router's kvroute counterpart, and the same view), per measured
# worker results/validation/workers.csv, and results/validation/published.csv (simulated
# against every published figure of paper/reported/). Reruns when a merged simulation, a measurement, a published file or
# the coefficients (whose provenance says what is in sample) change.


rule validate:
    input:
        **get_validation_inputs(),
    output:
        summary=f"{RESULTS}/validation/summary.csv",
        published=f"{RESULTS}/validation/published.csv",
        workers=f"{RESULTS}/validation/workers.csv",
        machine=f"{RESULTS}/validation/machine.csv",  # the canary's times: the machine's drift, reported only
    params:
        sims=lambda wildcards, input: " ".join(f"--sim {d}" for d in sorted({str(Path(p).parent) for p in input.sim})),
        measured=lambda wildcards, input: " ".join(f"--measured {d}" for d in sorted({str(Path(p).parent) for p in input.measure})),
        reported=lambda wildcards, input: str(Path(input.reported[0]).parent),
        probes=lambda wildcards, input: " ".join(f"--coefficients {p}" for p in input.probes),
        out=output_dir("summary"),
    log:
        f"{RESULTS}/logs/validate.log",
    benchmark:
        f"{RESULTS}/benchmarks/validate.tsv"
    conda:
        "../../envs/analysis.yaml"
    shell:
        "kvroute validate {params.sims} {params.measured} {params.probes} --reported {params.reported:q} --out {params.out:q} > {log:q} 2>&1"


# What each GPU coefficient is worth to note 2's single-GPU predictions (`kvroute
# sensitivity`): one input at a time set to the A6000's value or to none, on the same
# draws. A diagnostic of Table 3's miss for the note to report, never a fit.
rule sensitivity:
    input:
        experiment=experiment_file("note2-a100"),
        hardware=sorted(glob.glob("hardware/*.yaml")),
        code=SIM_SOURCES + _sources("src/kvroute/analysis/sensitivity.py"),
    output:
        f"{RESULTS}/validation/sensitivity-note2-a100.csv",
    log:
        f"{RESULTS}/logs/sensitivity.log",
    benchmark:
        f"{RESULTS}/benchmarks/sensitivity.tsv"
    conda:
        "../../envs/analysis.yaml"
    shell:
        "kvroute sensitivity {input.experiment:q} --out {output:q} > {log:q} 2>&1"
