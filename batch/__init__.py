"""Offline batches: the rq jobs (jobs.py) and the client that sends their requests into the
farm the way the gateway does (farm_client.py). Above the gateway and the workers in the
layers: it uses the gateway's request handling and the broker's streams."""
