"""Draft heads on a frozen target, for inference: the EAGLE head (``model``), its saved format (``saved``), its
drafting paths (``drafting``) and sampling temperature (``calibrate``); Medusa heads and their format
(``medusa``). Their training is ``specdecode.training``'s."""
