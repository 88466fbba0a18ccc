"""Five JSON schemas for structured-output tests: nested objects, arrays, enums, bounded integers,
required fields."""

NESTED = {
    "type": "object",
    "properties": {
        "person": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"],
                },
            },
            "required": ["name", "address"],
        }
    },
    "required": ["person"],
}
ARRAY = {
    "type": "object",
    "properties": {
        "colors": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 4,
        }
    },
    "required": ["colors"],
}
ENUM = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
    },
    "required": ["sentiment", "size"],
}
BOUNDED = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "score": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
    },
    "required": ["age", "score"],
}
REQUIRED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "title": {"type": "string", "maxLength": 20},
        "done": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["id", "title", "done"],
    "additionalProperties": False,
}
SCHEMAS = {"nested": NESTED, "array": ARRAY, "enum": ENUM, "bounded": BOUNDED, "required": REQUIRED}
PROMPT = [{"role": "user", "content": "Tell me about your favourite day out."}]

LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 12},
        "customer_primary_shipping_address_city": {"type": "string", "maxLength": 12},
        "customer_loyalty_programme_membership_level": {"enum": ["bronze", "silver", "gold"]},
        "number_of_items_in_the_shopping_basket": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": [
        "customer_full_legal_name",
        "customer_primary_shipping_address_city",
        "customer_loyalty_programme_membership_level",
        "number_of_items_in_the_shopping_basket",
    ],
}
