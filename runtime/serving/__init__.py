"""The OpenAI-compatible server (`autotune serve`): engine (model, queue, prefix cache), HTTP app, runner."""
