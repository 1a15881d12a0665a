"""The trajectory compressor: fits finished ShareGPT trajectories into a token budget by replacing
the middle of a long conversation with a summary written by a model.

tokens.py counts tokens (a Hugging Face tokenizer, or an estimate); plan.py chooses the turns to
summarise and builds the compressed conversation; summariser.py asks the model (through
agent.model_client, the project's one model client); journal.py keeps what is finished so an
interrupted compression resumes without paying twice; compressor.py runs a file; metrics.py
describes a row and the whole run.

May import runner.input and runner.storage (rows are read through runner.storage.records).
"""
