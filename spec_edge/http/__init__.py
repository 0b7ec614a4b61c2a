"""The OpenAI-compatible HTTP door (docs/http.md): FastAPI on uvicorn onto the one scheduler (runtime/scheduler.py).
`spec-edge http` runs it alone; the ROS node runs it beside its ROS interfaces when http.enabled. It imports config
and runtime only; ros2 and cli import it."""
