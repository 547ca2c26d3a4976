"""Analysis: statistics over rounds, goodput, the study outputs, and the LaTeX writers.

Notebooks stay thin: they read records (``kvroute.records``), call these functions and
draw. Everything a note prints comes from a file written here: ``tables`` (booktabs
tabulars), ``numbers`` (one ``\\newcommand`` per number) and ``manifest_tex``
(the provenance appendix).

Modules:
    stats        mean and t-based confidence interval over rounds
    goodput      requests per second meeting a service class (TTFT and TPOT targets)
    load_curves  metrics against an experiment's load axis, per policy, over rounds
    tables       LaTeX tables (booktabs + siunitx), escaping, atomic writes
    numbers      number macros for prose (numbers/*.tex)
    arithmetic   technical note 4: closed-form hit rates and the checking sweep
    kv_reuse     the multi-turn KV reuse study's outputs and claim tests
    note2        research note 2's tables (published | simulated | measured)
    sticky       the sticky-routing explainer's arithmetic and measurement
    figures      shared figure style and saving (PDF + PNG, provenance metadata), curves against load
    results_io   reading results/sim/<exp> and results/measure/<exp>
    manifest_tex the provenance appendix from results/manifest.json
    latex        compiling a note with latexmk (TEXINPUTS on results/ and paper/common/)
"""
