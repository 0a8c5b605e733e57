"""``eagle3kit diagnose``: why a serving engine accepts less than the drafter predicts."""
