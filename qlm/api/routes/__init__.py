"""One router per resource: requests (native API), openai (compatible endpoints), admin
(operators), health (probes and metrics)."""
