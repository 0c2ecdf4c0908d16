"""The answer step after grading: quoted evidence, the check of a generated answer, the keyword rewrite."""
