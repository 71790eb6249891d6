"""HTTP entry points. They talk to the engine through AsyncEngine only, never to llama.cpp."""
