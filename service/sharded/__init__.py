"""Sharded serving on Ray Serve, the only part of the service that imports Ray:

    command.py         `python -m service --ray`: start, deploy, stop
    deployments.py     the Serve application: shard deployments and the ingress running the HTTP app
    placement.py       Serve's environment, the ports it takes, whether the replicas fit
    sharded_engine.py  the engine over shards: scatter the query vectors, merge the exact top-k
    stop_signal.py     the stop every ingress replica sees at once, to drain"""
