"""Training the draft heads of ``specdecode.heads``: the data readers (``data``), long chats as windows
(``windows``), which rows a loss counts (``answer_rows``), the feature cache and the training loop of the EAGLE
head (``train``), the target's own answers and questions as training data (``answers``, ``questions``,
``padded``). Never imported by ``import specdecode``: the CLI's training commands load it when they run."""
