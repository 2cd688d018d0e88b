"""The drafter: the model (`drafter`), attention masks (`masks`), anchors, loss, the served class copied into exports (`modeling_dflash`) and the export format (`export`)."""
