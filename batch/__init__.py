"""Offline batches: the rq jobs (jobs.py) and the client that sends their requests into the
farm the way the gateway does (farm_client.py). Above the API layer and the workers in the
layers: it uses the API's request handling (syshax.api) and the broker's streams, never the
gateway."""
