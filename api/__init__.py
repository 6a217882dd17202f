"""The OpenAI API without HTTP (torch-free): request bodies (schemas.py), their per-request
limits (limits.py), the plan a body becomes (prepare.py), errors in OpenAI's shape (errors.py),
the choices and body of an answer (choices.py), and the settings of any client of the farm
(settings.py). Below both the gateway and batch/, so each answers exactly as the other."""
