"""eagle3kit: train EAGLE-3 drafters for a target LLM and prove they work where they are served.

Pipeline stages (one module each, docs/architecture.md): prompts → generate → tokenize → vocab → train →
export → evaluate; :func:`eagle3kit.pipeline.run` chains them.
"""

__version__ = "0.1.0"
