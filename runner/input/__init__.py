"""Input: the flags (one declaration each), the validated RunConfig, the dataset rows, the API keys.

Nothing here imports another stage; every other stage may import it.
"""
