"""Draft heads trained on a frozen target: the EAGLE head (``model``), its saved format (``saved``), the data
readers (``data``) and the training loop (``train``); Medusa heads, their format and training (``medusa``)."""
