"""The names of the backends a transformer runs on (models/onnx_backend.py runs them), apart from
it so that reading them (the service's settings) imports neither torch nor ONNX Runtime."""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["torch", "onnx", "onnx-int8"]
BACKENDS: tuple[str, ...] = get_args(Backend)
