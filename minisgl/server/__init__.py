"""Online serving: `python -m minisgl` starts the processes (launch) and serves the HTTP API or the shell."""
