"""Building a grader: labelled and synthetic batches, training pairs and the reader, thresholds, the grade report."""
