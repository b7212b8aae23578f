"""The HTTP transport: everything that knows of requests, status codes and bodies.

    app.py        the app factory: the routers, the error mapping and the middleware over one Runtime
    routes/       one router per group of routes, and the body and answer helpers they share
    schemas.py    the request and response bodies
    status.py     each domain error's status code and body, in one place
    protocol.py   uvicorn's HTTP protocol, with read and write timeouts and the earliest refusal
    admission.py  the cap on searches in the service
    limits.py     limits on bodies and on values the settings bound

It imports service.engine, never the other way round."""
