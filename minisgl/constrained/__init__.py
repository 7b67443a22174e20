"""Structured output: grammars that constrain what a request may generate."""
