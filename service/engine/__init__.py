"""The engine and what runs it, below HTTP:

    search_engine.py  SearchEngine: encode, retrieve (a Searcher), rerank, timings; SearchPlan, SearchResult
    runtime.py        the engine as served: loaded in the background, one model thread, reloads
    batcher.py        the micro-batcher in front of the model thread
    index_watch.py    SEARCH_WATCH_INDEX: a new generation in the folder reloaded
    monitoring.py     the metrics (/metrics, /stats)
    tracing.py        OpenTelemetry spans, where an endpoint is set
    allocator.py      jemalloc for the process and for Ray's replicas

It imports service.errors and service.settings, never service.http or service.sharded."""
