# Stage 3, measure: live runs of the live stack (`kvroute measure`: engines up, gateway up,
# load, engines down). Included only when measure.enabled is true (see the Snakefile).
# Two rules, so executors can place them: GPU profiles ask for the profile's GPU count as
# the `gpu` resource (slurm: --gpus; kubernetes: nvidia.com/gpu), CPU profiles (vLLM's CPU
# build) ask for cores only. Both are single jobs per experiment x hardware: a measurement
# owns its machine while it runs.


rule measure_gpu:
    input:
        experiment=get_measure_experiment,
        hardware=get_measure_hardware_files,
        sources=LIVE_SOURCES,
        policy_sources=get_measure_policy_sources,  # the policies it runs, not every policy
    output:
        requests="results/measure/{mexp}/{mhw}/requests.parquet",
        summary="results/measure/{mexp}/{mhw}/summary.csv",
    wildcard_constraints:
        mhw=_alternation(get_measure_hardware(cpu=False)),
    params:
        out=output_dir("requests"),
        rounds=get_measure_rounds_arg,
    threads: 8
    resources:
        gpu=get_measure_gpus,
        gpu_manufacturer="nvidia",
        mem_mb=64000,
        runtime=240,
    log:
        "results/logs/measure/{mexp}/{mhw}.log",
    benchmark:
        "results/benchmarks/measure/{mexp}/{mhw}.tsv"
    conda:
        "../../envs/engine-gpu.yaml"
    shell:
        "kvroute -v measure {input.experiment:q} --hardware {wildcards.mhw:q} --out {params.out:q} {params.rounds} > {log:q} 2>&1"


rule tiny_model:  # the CPU profile's model: random weights, local tokenizer, deterministic
    output:
        "results/models/tiny-qwen2/config.json",
    log:
        "results/logs/measure/tiny_model.log",
    benchmark:
        "results/benchmarks/measure/tiny_model.tsv"
    conda:
        "../../envs/engine-cpu.yaml"
    shell:
        "kvroute model tiny results/models/tiny-qwen2 > {log:q} 2>&1"


# With measure.probe (the default), a CPU measurement also probes its engines: `kvroute
# measure --probe` sends probe requests of its own before and after the measurement, on the
# very processes it measures, and writes them apart from the records
# (results/measure/EXP/HW/probe.json); rule probe_fit fits them. A probe run minutes
# before, in a job of its own, missed the machine's speed at measurement time by 10-25%
# (docs/validation.md).
MEASURE_CPU_OUTPUTS = {
    "requests": "results/measure/{mexp}/{mhw}/requests.parquet",
    "summary": "results/measure/{mexp}/{mhw}/summary.csv",
} | ({"probed": "results/measure/{mexp}/{mhw}/probe.json"} if is_probe_enabled() else {})


CPU_SESSION = get_cpu_session() if is_engine_session_shared() else []

if CPU_SESSION:

    rule measure_cpu:
        # measure.share_engines (the default): every CPU experiment in one job, one after
        # another on one set of engine processes (`kvroute measure EXP... --out D...`), so the
        # engines start once and one probe session between two experiments closes the first's
        # bracket and opens the next's (docs/costmodel.md). Editing one of them re-measures all.
        # kvroute measure runs from the main environment; the vLLM servers it starts use
        # .venv-engine-cpu (`make engine-cpu`), found without configuration.
        input:
            experiments=[experiment_file(e) for e in CPU_SESSION],
            hardware=get_measure_hardware_files,
            sources=LIVE_SOURCES,
            policy_sources=get_cpu_session_policy_sources,  # the policies they run, not every policy
            model=rules.tiny_model.output,
        output:
            **{f"{k}_{i}": v.replace("{mexp}", e) for i, e in enumerate(CPU_SESSION) for k, v in MEASURE_CPU_OUTPUTS.items()},
        wildcard_constraints:
            mhw=_alternation(get_measure_hardware(cpu=True)),
        params:
            args=get_cpu_session_args,
        threads: workflow.cores  # the whole machine: a simulation beside it would slow the engines
        resources:
            mem_mb=12000,
            runtime=60 * max(1, len(CPU_SESSION)),
            measure_slot=1,  # one measurement at a time: two would share the same cores
        log:
            "results/logs/measure/{mhw}.log",
        benchmark:
            "results/benchmarks/measure/{mhw}.tsv"
        conda:
            "../../envs/engine-cpu.yaml"
        shell:
            "kvroute -v measure {params.args} --hardware {wildcards.mhw:q} > {log:q} 2>&1"

else:

    rule measure_cpu:
        # measure.share_engines: false: one job per experiment, each starting its own engines.
        # kvroute measure runs from the main environment; the vLLM servers it starts use
        # .venv-engine-cpu (`make engine-cpu`), found without configuration.
        input:
            experiment=get_measure_experiment,
            hardware=get_measure_hardware_files,
            sources=LIVE_SOURCES,
            policy_sources=get_measure_policy_sources,  # the policies it runs, not every policy
            model=rules.tiny_model.output,
        output:
            **MEASURE_CPU_OUTPUTS,
        wildcard_constraints:
            mhw=_alternation(get_measure_hardware(cpu=True)),
            mexp=_alternation(e for e, _ in get_measure_runs()),
        params:
            out=output_dir("requests"),
            rounds=get_measure_rounds_arg,
            probe=lambda wildcards, output: f"--probe {output.probed}" if hasattr(output, "probed") else "",
        threads: workflow.cores  # the whole machine: a simulation beside it would slow the engines
        resources:
            mem_mb=12000,
            runtime=60,
            measure_slot=1,  # one measurement at a time: two would share the same cores
        log:
            "results/logs/measure/{mexp}/{mhw}.log",
        benchmark:
            "results/benchmarks/measure/{mexp}/{mhw}.tsv"
        conda:
            "../../envs/engine-cpu.yaml"
        shell:
            "kvroute -v measure {input.experiment:q} --hardware {wildcards.mhw:q} --out {params.out:q} {params.rounds}"
            " {params.probe} > {log:q} 2>&1"


rule probe_fit:
    # `kvroute calibrate --probe --probed`: the family's coefficients fitted, with their
    # errors, to the probe requests a CPU measurement sent its engines (docs/costmodel.md).
    # Its input is that probe file only, never the records beside it; that experiment's
    # simulations use its output (get_sim_coefficients), so they are predictions of the
    # measurement. Editing the fit reruns this job, not the measurement.
    input:
        probed="results/measure/{mexp}/{mhw}/probe.json",
        hardware=get_measure_hardware_files,
        sources=PROBE_FIT_SOURCES,
    output:
        coefficients="results/calibration/probe/{mexp}/{mhw}.yaml",
        observations="results/calibration/probe/{mexp}/{mhw}.csv",
    wildcard_constraints:
        mexp=_alternation(e for e, _ in get_probe_runs()),
        mhw=_alternation(get_probe_hardware()),
    resources:
        mem_mb=2000,
        runtime=10,
    log:
        "results/logs/calibrate/probe/{mexp}/{mhw}.log",
    benchmark:
        "results/benchmarks/calibrate/probe/{mexp}/{mhw}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute calibrate --probe --probed {input.probed:q} --hardware {wildcards.mhw:q} --out {output.coefficients:q} > {log:q} 2>&1"


rule probe:
    # `kvroute calibrate --probe`: the CPU profile's engines started and profiled with probe
    # requests of their own (prefill cold and warm, decode by batch and context, the API
    # server's cost), the family's coefficients fitted with their errors (docs/costmodel.md).
    # It reads no experiment. Not in `paper` (each measurement probes its own engines, above):
    # a calibration of its own, on request (`snakemake results/calibration/probe/cpu.yaml`).
    input:
        hardware=lambda wildcards: [f"hardware/{wildcards.phw}.yaml", "hardware/models.yaml", "hardware/coefficients.yaml"],
        sources=PROBE_SOURCES,
        model=rules.tiny_model.output,
    output:
        coefficients="results/calibration/probe/{phw}.yaml",
        observations="results/calibration/probe/{phw}.csv",
    wildcard_constraints:
        phw=_alternation(get_probe_hardware()),
    threads: workflow.cores  # the whole machine, as a measurement
    resources:
        mem_mb=12000,
        runtime=30,
        measure_slot=1,
    log:
        "results/logs/calibrate/probe/{phw}.log",
    benchmark:
        "results/benchmarks/calibrate/probe/{phw}.tsv"
    conda:
        "../../envs/engine-cpu.yaml"
    shell:
        "kvroute -v calibrate --probe --hardware {wildcards.phw:q} --out {output.coefficients:q} > {log:q} 2>&1"


rule calibrate:
    # `kvroute calibrate`: the hardware family's step-time coefficients fitted to a measured
    # run (measure.runs[].calibrate), by replaying its workload through the simulator: in
    # sample, for comparison only. It writes a coefficients.yaml entry and the errors before
    # and after; hardware/ is never edited and no simulation uses it (docs/costmodel.md).
    input:
        experiment=get_measure_experiment,
        hardware=get_measure_hardware_files,
        measured="results/measure/{mexp}/{mhw}/requests.parquet",
        sources=CALIBRATE_SOURCES,
    output:
        coefficients="results/calibration/{mexp}/{mhw}.yaml",
        errors="results/calibration/{mexp}/{mhw}.csv",
    wildcard_constraints:
        mexp=_alternation(e for e, _ in get_measure_runs()),  # not probe/EXP: the probes' own files
    resources:
        mem_mb=2000,
        runtime=30,
    log:
        "results/logs/calibrate/{mexp}/{mhw}.log",
    benchmark:
        "results/benchmarks/calibrate/{mexp}/{mhw}.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute calibrate {input.experiment:q} {input.measured:q} --hardware {wildcards.mhw:q} --out {output.coefficients:q} > {log:q} 2>&1"
