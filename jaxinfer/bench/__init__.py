"""`jaxinfer bench`: offline throughput (the engine in process) and online serving latency (a
running server's /v1/completions, streamed) over a synthetic workload, reported with vLLM's
`bench serve` metric names (serve/ is not needed: the online client speaks plain HTTP)."""
