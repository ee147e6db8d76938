"""How a candidate's accuracy is judged, shared by the precision stage (choosing a variant) and validation (gating
an engine): the held-out data at every validated shape, the comparison against a reference, the gates and the
user's metric. Not a stage: both stages import it, so a variant is accepted by the check its engines will face."""
