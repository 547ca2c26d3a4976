# Provenance: results/manifest.json (commit, package versions, hardware profiles, config
# and experiment hashes, which results are simulated, measured or emulated) and the same
# as LaTeX, results/manifest.tex, which every note prints in its appendix
# (`\input{manifest.tex}`). It reruns when any result, the config, an experiment file or a
# hardware profile changes.


rule manifest:
    input:
        config="config/config.yaml",
        experiments=get_experiment_files(),
        hardware=get_all_hardware_files(),
        results=get_sim_targets() + get_measure_targets(),
        code=MANIFEST_SOURCES,
    output:
        json="results/manifest.json",
        tex="results/manifest.tex",
    params:
        results=output_dir("json"),
    log:
        "results/logs/manifest.log",
    benchmark:
        "results/benchmarks/manifest.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "kvroute manifest --out {output.json:q} --tex {output.tex:q} --results {params.results:q} > {log:q} 2>&1"
