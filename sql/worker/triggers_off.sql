-- The partitions of outbox.log whose triggers a restore or a copy left
-- off (outbox.triggers_off()): each generation, whether its triggers are
-- still disabled (the restore under way), and its size in pages.
SELECT t.generation, t.disabled, t.pages FROM outbox.triggers_off() AS t ORDER BY t.generation
