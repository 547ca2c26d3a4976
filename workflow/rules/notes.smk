# Stage 5, notes: latexmk per note. The note is copied with paper/common/ into a scratch
# folder results/build/NOTE/ (the source tree stays clean) and built there with results/
# and the copied common/ on TEXINPUTS (common/ also on BIBINPUTS), so `\input{preamble.tex}`,
# `\bibliography{refs}`, `\input{numbers/...}`, `\input{tables/...}`,
# `\input{manifest.tex}` and `\includegraphics{figures/...}` resolve (as in
# kvroute.analysis.latex; paths relative to paper/, such as common/preamble.tex, too). The PDF is moved into
# results/paper/ only after latexmk succeeded. A note depends on its own .tex files,
# paper/common/, the products of the analyses the config lists for it and the provenance
# table: editing its prose reruns only LaTeX. Rule note_layout then reads TeX's log: a box
# overfull by more than 1 pt (text in the margin, a table cut at the page's foot) fails it.


rule note:
    input:
        sources=get_note_sources,
        products=get_note_products,
        provenance="results/manifest.tex",
    output:
        pdf="results/paper/{note}.pdf",
        latex_log="results/paper/{note}.latex.log",  # TeX's main.log, for rule note_layout
    params:
        results=input_dir("provenance"),
    log:
        "results/logs/notes/{note}.log",
    benchmark:
        "results/benchmarks/notes/{note}.tsv"
    conda:
        "../../envs/latex.yaml"
    shell:
        """
        root=$PWD results=$(cd {params.results:q} && pwd) build="$(dirname {output.pdf:q})/../build/{wildcards.note}"
        rm -rf "$build" && mkdir -p "$build" && build=$(cd "$build" && pwd)
        cp -R paper/{wildcards.note} "$build"/{wildcards.note}
        if [ -d paper/common ]; then cp -R paper/common "$build"/common; fi
        cd "$build"/{wildcards.note}
        export TEXINPUTS=".:$results/:$build/common/:$build/:" BIBINPUTS=".:$build/common/:$build/:" BSTINPUTS=".:$build/common/:$build/:"
        export max_print_line=10000  # unwrapped log: latexmk misses "No file main.bbl." after a wrapped 79-character line
        if ! latexmk -pdf -interaction=nonstopmode -halt-on-error -file-line-error main.tex > "$root"/{log:q} 2>&1; then
            echo "latexmk failed; end of main.log:" >> "$root"/{log:q}
            tail -n 40 main.log >> "$root"/{log:q} 2>/dev/null || true
            exit 1
        fi
        cd "$root"
        cp "$build"/{wildcards.note}/main.log {output.latex_log:q}
        mv "$build"/{wildcards.note}/main.pdf {output.pdf:q}
        """


rule note_layout:
    input:
        latex_log="results/paper/{note}.latex.log",
    output:
        checked="results/paper/{note}.layout.txt",
    log:
        "results/logs/notes/{note}.layout.log",
    conda:
        "../../envs/simulation.yaml"
    shell:
        "python -m kvroute.analysis.latex {input.latex_log:q} > {log:q} 2>&1"
        " && echo 'no overfull box over 1 pt' > {output.checked:q}"
