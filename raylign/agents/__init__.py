"""Agentic multi-turn RL: environments, token-in/token-out episodes, tools, the code sandbox and
the OpenAI-compatible endpoint. Nothing here knows about training or losses."""
