"""Recipes: public models (Llama 3 family, GPT-OSS) trained in live mode from a YAML file,
with no code of the user's. `catalog` lists and resolves them (no torch needed); `run` is
what every worker of a recipe job runs."""
