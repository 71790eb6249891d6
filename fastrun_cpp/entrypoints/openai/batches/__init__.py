"""OpenAI's Batch API: files of requests run at bulk priority, surviving restarts."""
