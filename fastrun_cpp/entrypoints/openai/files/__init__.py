"""OpenAI's Files API, for batch input and output files."""
