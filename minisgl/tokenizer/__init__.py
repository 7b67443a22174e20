"""The tokenizer worker: prompts to token ids for the scheduler, its tokens back to text for the API server."""
