# Stage 4, analyse: one papermill rule per notebook (analyse_NOTEBOOK). A notebook takes
# `results_dir` (where sim/ and measure/ are) and `out_dir` (where it writes); it runs with
# out_dir in a scratch folder, and its products are moved into results/ only when the
# notebook finished and wrote every declared output, so no half-written figure is ever
# taken for a finished one. The executed copy is kept as results/analysis/NOTEBOOK.ipynb.
# Inputs: the notebook, the code it imports (src/kvroute/analysis/), the merged results it
# reads and the files the config lists, and nothing else, so editing one notebook reruns
# only its outputs and the notes using them.

for _entry in get_analyses():

    rule:
        name:
            f"analyse_{_entry['notebook']}"
        input:
            **get_analysis_inputs(_entry["notebook"]),
        output:
            **analysis_output_files(_entry["notebook"]),
        params:
            results_dir=output_dir("executed", up=2),
            scratch=scratch_for("executed"),
            products=get_analysis_outputs(_entry["notebook"]),
        log:
            f"results/logs/analyse/{_entry['notebook']}.log",
        benchmark:
            f"results/benchmarks/analyse/{_entry['notebook']}.tsv"
        conda:
            "../../envs/analysis.yaml"
        shell:
            """
            scratch={params.scratch:q}
            rm -rf "$scratch" && mkdir -p "$scratch/out"
            papermill {input.notebook:q} "$scratch/executed.ipynb" -k python3 --log-output --no-progress-bar \
                -p results_dir {params.results_dir:q} -p out_dir "$scratch/out" > {log:q} 2>&1
            for p in {params.products:q}; do
                case "$p" in figures/*|tables/*) mkdir -p "$scratch/out/$p" ;; esac
                if [ ! -e "$scratch/out/$p" ]; then
                    echo "{input.notebook} did not write $p under out_dir" | tee -a {log:q} >&2; exit 1
                fi
            done
            for p in {params.products:q}; do
                target={params.results_dir:q}/"$p"
                mkdir -p "$(dirname "$target")" && rm -rf "$target" && mv "$scratch/out/$p" "$target"
            done
            find "$scratch/out" -type f | sed 's/^/not declared in config, discarded: /' >> {log:q}
            mv "$scratch/executed.ipynb" {output.executed:q} && rm -rf "$scratch"
            """
