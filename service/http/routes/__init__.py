"""The HTTP routes, one module per feature (FastAPI routers); service/http/app.py assembles them."""
