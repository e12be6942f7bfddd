"""The OpenAI-compatible HTTP ingress of `slotserve serve`: request and error shapes
(`openai_protocol`), tokenizing, checking and streaming through the Python client (`ingress`),
the FastAPI routes (`app`), and the run its traffic is recorded under (`recorder`)."""
