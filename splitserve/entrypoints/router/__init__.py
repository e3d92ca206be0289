"""`splitserve router`: one endpoint in front of many OpenAI-compatible servers.

The router itself is vLLM's Rust router (the `vllm-router` package, `pip install splitserve[router]`);
this package only maps splitserve's flags onto it and starts it (`launcher.py`). It is a pure HTTP
process: nothing here imports the engine.
"""
