# kvroute: `snakemake --cores 8 paper` rebuilds every figure, table, number and note.
# Table of contents: the config (validated first, in common.smk), the stages in order, the
# targets. docs/pipeline.md is the contract between stages; config/README.md the config.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/workload.smk"
include: "workflow/rules/simulate.smk"
if is_measure_enabled():
    include: "workflow/rules/measure.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/gateway.smk"
include: "workflow/rules/analyse.smk"
include: "workflow/rules/notes.smk"
include: "workflow/rules/manifest.smk"
include: "workflow/rules/field.smk"


localrules: paper, sim, measure, figures, tables, merge, manifest, validation, field


rule paper:  # the default: every note and the manifest
    default_target: True
    input: get_paper_targets(),

rule sim:  # every simulation, merged
    input: get_sim_targets(),

rule measure:  # every live measurement (none while measure.enabled is false)
    input: get_measure_targets(),

rule validation:  # every prediction beside its measurement and published value
    input: get_validation_targets(),

rule figures:
    input: get_figure_targets(),

rule field:  # `make field`: the field_experiments (Mooncake's whole traces), not part of paper
    input: get_field_targets(),

rule tables:  # tables, number macros and the provenance appendix
    input: get_table_targets(),
