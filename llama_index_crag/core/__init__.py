"""The corrective loop: the engine, its parts (grader, refiner, fallback, rewrite), prompts, trace and settings."""
