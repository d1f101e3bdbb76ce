// Placeholder until the file-system layer lands (owned by the checkpoint work).
