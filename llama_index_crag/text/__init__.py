"""The bottom of the package: clean text, split it into sentences, words and knowledge strips."""
