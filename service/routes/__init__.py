"""The HTTP routes, one module per feature (FastAPI routers); service/app.py assembles them."""
