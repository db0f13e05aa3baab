"""Sub-commands beyond plan/predict. Each module has `register(subparsers)`; imports stay cheap."""
