# Stage 3c, gateway: the gateway's added latency, measured on this machine for research
# note 2's engineering observation (its gateway first added 50 ms per later turn, then
# about 1 ms). A short run of benchmarks/gateway_latency.py (the full one is in
# `make bench`): kvroute's gateway, with its session table in memory and in a local
# redis-server, against the client choosing the backend itself, on trivial and on
# EMULATED-pace streaming backends (no engine, no model). Under 30 s here. It takes the
# whole machine while it runs, as a measurement does, so no simulation shares its cores.
# Included whether or not measure.enabled: it starts no engine.

from kvroute.pipeline import policy_sources

# the gateway's code and the one policy it routes with (editing another policy reruns nothing here)
GATEWAY_SOURCES = sorted(set(_sources("src/kvroute/live/*.py", "src/kvroute/kvcache/*.py", "src/kvroute/records.py")
                             + policy_sources("kv_aware")))


rule gateway_latency:
    input:
        script="benchmarks/gateway_latency.py",
        sources=GATEWAY_SOURCES,
    output:
        csv=f"{RESULTS}/gateway/latency.csv",
    threads: workflow.cores
    resources:
        measure_slot=1,  # never beside a measurement: both want every core
    log:
        f"{RESULTS}/logs/gateway/latency.log",
    benchmark:
        f"{RESULTS}/benchmarks/gateway/latency.tsv"
    conda:
        "../../envs/simulation.yaml"
    shell:
        "python {input.script:q} --policy kv_aware --targets kvroute,kvroute-redis --loads sequential,paced"
        " --rounds 3 --sequential 10 --concurrent 64 --turns 4 --pace-chunks 8 --no-goals --csv {output.csv:q}"
        " > {log:q} 2>&1"
