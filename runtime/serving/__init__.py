"""The OpenAI- and Anthropic-compatible server (`autotune serve`): engine, HTTP app, queue, prefix cache."""
