"""lm-eval task definitions (YAML) over the LLM-Adapters test files, and their document loaders."""
