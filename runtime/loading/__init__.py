"""Loading models: built-in names and dtypes, checks on a checkpoint's files, its key layouts read into place, and the
experts' weights a build converts."""
