"""Code that runs inside a vLLM server process (its own virtual environment): only the standard
library and torch, never megarl, so the server can import it from this directory alone."""
