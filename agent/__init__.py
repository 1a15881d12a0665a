"""The agent: model access, the tool-calling loop, trajectory conversion and the offline model."""
